"""`mdsl serve`: the OpenAI-compatible HTTP server over the serving engine (`mdsl.LLM`). Its modules
import Starlette, uvicorn, jinja2 and prometheus_client (the `serve` extra); `mdsl.server.cli` adds the
command without importing them."""
