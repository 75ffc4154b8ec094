"""OpenAI-compatible serving: `protocol` (request validation, response shapes) and `app` (FastAPI + uvicorn)."""
