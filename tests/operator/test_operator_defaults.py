"""One default, everywhere: what `verifypd serve` loads without --target/--draft is what a
VerifyPDConfig without `model` gets, through the CRD's structural defaults, the operator's spec
parser, the chart's default config and the shipped example."""

from __future__ import annotations

import pytest
import yaml
from operator_helpers import CHART, CRD_FILE, EXAMPLE, ROOT

from verifypd_operator.builders import build_all
from verifypd_operator.spec import parse_spec


def _cli_model() -> dict:
    """The model `verifypd serve` loads when neither --target nor --draft is given (and how: no
    --quantization is the CRD's "none"; --kv-cache-dtype's default is its kvCacheDtype's)."""
    from verifypd.cli import build_parser, draft_arg

    args = build_parser().parse_args(["serve"])
    return {
        "target": args.target,
        "draft": draft_arg(args),
        "quantization": args.quantization or "none",
        "kvCacheDtype": args.kv_cache_dtype,
    }


def _crd_model_default() -> dict:
    """The `spec.model` an API server fills in for a CR that leaves it out (the committed CRD)."""
    crd = yaml.safe_load(CRD_FILE.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["default"]["model"]


def test_crd_default_model_is_the_clis():
    cli = _cli_model()
    assert _crd_model_default() == cli
    parsed = parse_spec({})
    assert {
        "target": parsed.target,
        "draft": parsed.draft,
        "quantization": parsed.quantization,
        "kvCacheDtype": parsed.kv_cache_dtype,
    } == cli


@pytest.mark.parametrize(
    "where", ["chart defaultConfig", *sorted(str(p.relative_to(ROOT)) for p in EXAMPLE.parent.glob("*.yaml"))]
)
def test_shipped_configs_do_not_override_the_default_model(where):
    """A shipped config may leave `model` out (the CRD default applies) or spell the default."""
    if where == "chart defaultConfig":
        spec = yaml.safe_load((CHART / "values.yaml").read_text())["defaultConfig"]["spec"]
    else:
        spec = yaml.safe_load((ROOT / where).read_text())["spec"]
    model = spec.get("model") or {}
    cli = _cli_model()
    assert {k: v for k, v in model.items() if k in cli} == {k: cli[k] for k in model if k in cli}


@pytest.mark.parametrize("topology", ["colocated", "split"])
def test_pods_of_an_empty_spec_run_the_default_draft(owner, topology):
    """The operator hands the default model to every container it starts (`--draft ngram`)."""
    cli = {k: v for k, v in _cli_model().items() if k not in ("quantization", "kvCacheDtype")}
    objs = build_all(parse_spec({"topology": topology}), owner, "default", {}, "otel:4317")
    containers = [c for o in objs if o["kind"] == "Deployment" for c in o["spec"]["template"]["spec"]["containers"]]
    given = [
        {"target": a[a.index("--target") + 1], "draft": a[a.index("--draft") + 1]}
        for a in (c["args"] for c in containers)
        if "--draft" in a
    ]
    assert given and all(g == cli for g in given)
    assert not any("--quantization" in c["args"] for c in containers)  # "none": no flag
    assert not any("--kv-cache-dtype" in c["args"] for c in containers)  # "auto": no flag


def test_crd_speculation_defaults_are_the_routers():
    """A VerifyPDConfig without `speculation` gets the router's own draft-length bounds: kMin 0 lets
    the adaptive policy stop drafting where it does not pay (a floor of 1 forces a draft token every
    step), and the CRD, the spec parser and `RuntimeConfig` read one place (verifypd/domain/defaults.py)."""
    from verifypd.domain.config import RuntimeConfig

    router = RuntimeConfig()
    want = {"kMin": router.k_min, "kMax": router.k_max, "kInitial": router.k_initial}
    crd = yaml.safe_load(CRD_FILE.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props = spec["properties"]["speculation"]["properties"]
    assert {k: props[k]["default"] for k in want} == want
    parsed = parse_spec({}).speculation
    assert {"kMin": parsed.k_min, "kMax": parsed.k_max, "kInitial": parsed.k_initial} == want
