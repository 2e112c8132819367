"""The public gateway: what clients talk to. One asyncio event loop per gateway process; it reaches
the engine core only through verifypd.core (CoreClient over the core channel) and loads no model.

server.py          grpc.aio Generation + Control servicers, health, reflection; `Gateway`; in-process
                   cores for tests and benches (build_colocated / build_split over core.assembly)
http_api.py        the OpenAI-compatible HTTP API (Starlette) on the same loop
http_server.py     uvicorn on the gateway's loop
openai_convert.py  OpenAI JSON <-> GenerateRequest
json_body.py       untrusted JSON request bodies, parsed with limits
response_wire.py   Generate responses encoded straight to wire bytes
tools.py           OpenAI tool calling: tools, tool_choice and tool history checked (400s name the field)
tool_render.py     ... the prompt rendered with the chat template (or the generic Hermes-style one), the calls' grammar
tool_stream.py     ... the output parsed into content and tool_calls, streamed as OpenAI deltas
tool_call_json.py  ... one call's JSON object scanned as it is generated
"""
