"""The KServe V2 / Open Inference Protocol REST API: `/v2/...`."""
