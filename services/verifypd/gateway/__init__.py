"""The public gateway: what clients talk to. One asyncio event loop per gateway process.

server.py          grpc.aio Generation + Control servicers, health, reflection; `Gateway`
engine_client.py   the gateway's end of the core channel: submit/cancel/control, detokenization, stop strings
http_api.py        the OpenAI-compatible HTTP API (Starlette) on the same loop
http_server.py     uvicorn on the gateway's loop
openai_convert.py  OpenAI JSON <-> GenerateRequest
"""
