"""KServe v2 (Triton) inference protocol for paved: gRPC and HTTP, LLMs and classic models.

  server.py          `serve_kserve` / `KServeServer`: both listeners in the caller's event loop
  grpc_server.py     inference.GRPCInferenceService (tritonclient's stubs, grpc.aio)
  http_server.py     HTTP/REST v2 with the binary tensor and generate extensions (FastAPI)
  repository.py      models as the server sees them; request validation shared by transports
  llm.py             engine models with Triton's vLLM-backend tensors (via the Engine protocol)
  sampling.py        sampling_parameters <-> SamplingOptions, constraints included
  xgboost_model.py   XGBoost model directories; batcher.py: the dynamic batcher
  tensors.py         v2 tensors <-> numpy; errors.py: status codes for both transports

The remote engine that calls a KServe server is `paved.engine.kserve_engine`.
"""
