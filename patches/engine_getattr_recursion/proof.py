"""The judge of ``engine_getattr_recursion`` (used by ``zeroshim prove`` and tests/test_engine_getattr_recursion.py):
attribute lookups on a ZeRO-2 engine, 2 ranks."""

from zeroshim._prove import ranks_of

NAME = "engine_getattr_recursion"
ARGS = ()
#: what DeepSpeed 0.19.6 answers (read in its engine.py; run on 0.19.8)
EXPECTED = {"submodule": {"ok": True, "value": 2}, "buffer": {"ok": True, "value": 3.0},
            "property": {"ok": False, "error": "AttributeError: 'Engine' object has no attribute 'broken'"},
            "module_attr": {"ok": True, "value": 4},
            "missing": {"ok": False, "error": "AttributeError: 'Engine' object has no attribute 'no_such_attribute'"},
            "hasattr": {"ok": True, "value": False}}
RECURSING = ("submodule", "buffer", "property")


def judge(ranks):
    """Proven: without zeroshim the registered submodule, the buffer and the raising property end in
    RecursionError on every rank; with zeroshim every lookup answers as DeepSpeed 0.19.6, the others unchanged,
    and the engine trains to the same losses."""
    if len(ranks) < 2 or not all(r for r in ranks):
        return "a rank wrote nothing", "a rank wrote nothing", False
    recursed = all(r["without"][k]["error"].startswith("RecursionError") for r in ranks for k in RECURSING
                   if not r["without"][k]["ok"]) and all(not r["without"][k]["ok"] for r in ranks for k in RECURSING)
    answered = all(r["with"][k] == v for r in ranks for k, v in EXPECTED.items())
    unchanged = all(r["with"][k] == r["without"][k] for r in ranks for k in EXPECTED if k not in RECURSING) and \
        all(r["with"]["losses"] == r["without"]["losses"] for r in ranks)
    without = ("the registered submodule, buffer and raising property recursed until RecursionError" if recursed
               else "no lookup recursed")
    with_ = ("every lookup answered as DeepSpeed 0.19.6" if answered else "a lookup differs from 0.19.6") + (
        "" if unchanged else "; a lookup that worked, or training, changed")
    return without, with_, recursed and answered and unchanged


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
