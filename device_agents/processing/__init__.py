"""Pre- and post-processing as the manifest describes it, numpy only (plus an image decoder,
the ``agent-images`` extra, imported on first use).

    images      encoded image -> uint8 HWC pixels (simplejpeg for JPEG, Pillow for the rest)
    transforms  resize, letterbox, centre crop, and the ``Geometry`` that maps points back
    pre         ``Preprocessor``: a manifest's pre-processing steps, image -> model input
    post        ``Postprocessor``: softmax / sigmoid, top-k with labels, YOLO boxes + NMS

The agent's pre- and post-processing stages and the host's calibration loading run this same
code, so a device serves what the host validated.
"""
