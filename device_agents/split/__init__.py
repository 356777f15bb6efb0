"""Split inference on the device: the head of a cut runs here, the tail on a v2 server.

    client  a small Open Inference Protocol v2 client (binary tensor data, deadline, bearer token / TLS)
    link    RTT and bandwidth estimates (EWMA) from its own requests and light probes
    stage   the ``split`` stage of the pipeline: picks the cut for the current link from the
            manifest's plan, runs head + tail, and passes the request on to the local model
            (queue + infer) whenever the tail cannot answer well: nothing is lost

Configured by ``[split]`` (``device_agents.config.SplitConfig``); a model splits when its bundle
carries a split plan (the manifest's ``split``: heads in the bundle, tails on the server).
"""
