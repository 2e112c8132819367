"""verifypd-loadgen: open- and closed-loop load against the verifypd `Generate` protocol.

Depends on the public protocol only (`verifypd.v1` stubs); see docs/loadgen.md.
"""

__version__ = "0.1.0"

# Version of the results JSON layout (docs/loadgen.md). Bump it on any change to the key
# layout; tests/loadgen/golden_schema_keys.txt pins the layout of this version.
SCHEMA_VERSION = 5
# Versions `compare` still reads (2 added config.backend/url/model/openai_api/raw_records and the
# optional runs[].records; 3 added config.procs/workload/long_* and runs[].summary.client; 4 added
# config.trace_ratio and records' traceparent; 5 added config.trace_alternate_s; nothing was removed).
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4, 5)
