"""Floor 2: the domain types every room shares. Torch-free; imports nothing of ours but the wire stubs.

requests.py      request and sampling specs, outputs, finish reasons, InvalidRequest, limits
config.py        RuntimeConfig (what the operator and Control change while serving)
lanes.py         the lane protocol: PrefillLane / DraftLane / VerifyLane and their item types, KvHandle
drafts.py        what `--draft` means: DraftSpec and its parsing
lookup.py        prompt lookup beside a feature draft: what the router and the proposer share
defaults.py      defaults shared with the operator's CRD
metric_names.py  the telemetry contract between the services and the operator
tokenizer.py     text <-> token ids
convert.py       public API / Control protobufs <-> domain objects (the only place that knows both)
"""
