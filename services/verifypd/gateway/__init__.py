"""The public gateway: what clients talk to. One asyncio event loop per gateway process; it reaches
the engine core only through verifypd.core (CoreClient over the core channel) and loads no model.

server.py          grpc.aio Generation + Control servicers, health, reflection; `Gateway`; in-process
                   cores for tests and benches (build_colocated / build_split over core.assembly)
http_api.py        the OpenAI-compatible HTTP API (Starlette) on the same loop
http_server.py     uvicorn on the gateway's loop
openai_convert.py  OpenAI JSON <-> GenerateRequest
json_body.py       untrusted JSON request bodies, parsed with limits
response_wire.py   Generate responses encoded straight to wire bytes
"""
