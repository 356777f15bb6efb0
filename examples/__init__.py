"""Examples that ship with edgekit: real data and models, nothing downloaded.

- ``examples.digits``: the embedded default model (a digits CNN, its calibration and held-out data);
- ``examples.pretrained``: a real pretrained ONNX model found inside an installed wheel;
- ``examples.agent_process``: a real ``edgekit-agent`` daemon in a child process on loopback;
- ``examples.demo``: the end-to-end demo (``python -m examples.demo``).
"""
