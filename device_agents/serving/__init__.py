"""The agent's HTTP API: Open Inference Protocol v2 (``http``, ``codec``) and Prometheus ``metrics``."""
