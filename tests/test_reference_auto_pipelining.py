"""tilecore.compat.lib.auto_pipelining against the live reference 0.2.0: the same public
names, signatures (parameter names, kinds and defaults) and state fields.

Only the API can be compared: the reference's pipelining splits a step at its TPU
primitives (`sparse_dense_matmul_csr*`), which have no CPU lowering, so no
reference step can run here; `test_compat_auto_pipelining.py` checks the results
against the schedule instead.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from _reference_peer import requires_reference, run_reference
from tilecore.compat.lib.auto_pipelining import auto_pipelining, decompose, preprocess, utils

MODULES = {"auto_pipelining": auto_pipelining, "decompose": decompose,
           "preprocess": preprocess, "utils": utils}
CHECKED = {
    "auto_pipelining": ["EmbeddingPipeliningState", "PipeliningFunction", "init_state",
                        "finalize_pipelining", "auto_pipelining", "dump_jaxpr"],
    "decompose": ["FunctionRunner", "decompose"],
    "preprocess": ["validate_jaxpr", "preprocess"],
    "utils": ["is_embedding_lookup", "is_embedding_update", "get_embedding_lookup_eqn",
              "replace_embedding_lookup_eqn", "lookup_params", "update_params", "clone_vars",
              "inline_jaxpr"],
}


def describe(obj: object) -> list[list[str]]:
    """Each parameter as `[name, kind, default]` (annotations differ by design)."""
    return [[p.name, p.kind.name, repr(p.default)]
            for p in inspect.signature(obj).parameters.values()]  # pyright: ignore[reportArgumentType]


@requires_reference
def test_same_names_and_signatures(tmp_path: Path) -> None:
    run_reference(f"""
        import inspect, json, importlib
        checked = {CHECKED!r}
        out = {{}}
        for module, names in checked.items():
            mod = importlib.import_module(
                'jax_tpu_embedding.sparsecore.lib.auto_pipelining.' + module)
            for name in names:
                obj = getattr(mod, name)
                out[module + '.' + name] = [
                    [p.name, p.kind.name, repr(p.default)]
                    for p in inspect.signature(obj).parameters.values()]
        from jax_tpu_embedding.sparsecore.lib.auto_pipelining import auto_pipelining as ap
        out['state_fields'] = list(ap.EmbeddingPipeliningState._fields)
        out['state_defaults'] = [repr(v) for v in ap.init_state()]
        out['runner_fields'] = list(
            importlib.import_module(
                'jax_tpu_embedding.sparsecore.lib.auto_pipelining.decompose'
            ).FunctionRunner.__dataclass_fields__)
        (WORKDIR / 'api.json').write_text(json.dumps(out))
    """, tmp_path)
    want = json.loads((tmp_path / "api.json").read_text())
    for module, names in CHECKED.items():
        for name in names:
            assert describe(getattr(MODULES[module], name)) == want[f"{module}.{name}"], name
    assert list(auto_pipelining.EmbeddingPipeliningState._fields) == want["state_fields"]
    assert [repr(v) for v in auto_pipelining.init_state()] == want["state_defaults"]
    assert list(decompose.FunctionRunner.__dataclass_fields__) == want["runner_fields"]
