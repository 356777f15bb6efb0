"""Split inference, host side: where a model can be cut between a device and a v2 server, what
each cut costs at a given bandwidth and round-trip time, and which cut to use.

    graph    cut points (one tensor, or a small set, crosses) and head/tail sub-models
    measure  per-segment latency with ONNX Runtime here, bytes per cut, compression and its cost
    profile  latency profiles recorded elsewhere (on the device, on the server) as JSON
    plan     the end-to-end cost model and the best cut per bandwidth; the table
    plot     latency against bandwidth (PNG)

Heavy SDKs (onnx, onnxruntime, matplotlib) are imported inside the functions that use them.
"""
