"""inference.GRPCInferenceService (KServe V2 / Open Inference Protocol, with Triton's extensions):
servicer.py answers each RPC by converting it and delegating to the module that owns the step."""
