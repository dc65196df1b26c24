"""The judge of ``zero3_trace_rehook`` (used by ``zeroshim prove`` and tests/test_zero3_trace_rehook.py): ZeRO-3
with peft LoRA, generating through an unwrap-for-generation helper between training steps, 2 ranks."""

from zeroshim._prove import equal, ranks_of, shows_bug

NAME = "zero3_trace_rehook"
ARGS = ()
KEYS = ("losses", "param_sha256")


def judge(ranks):
    """Proven: on every rank, without zeroshim the LoRA run failed with the empty-deque IndexError; with zeroshim
    it trained to the reference's losses and parameters bit for bit; and the plain model's runs with and without
    zeroshim are equal bit for bit."""
    if not ranks or not all(r[k].get("ok") for r in ranks for k in ("reference", "with", "plain/without", "plain/with")):
        return "a run failed", "a run failed", False
    failed = all(not r["without"].get("ok") and shows_bug(NAME, r["without"].get("error")) for r in ranks)
    fixed = all(equal(r["with"], r["reference"], KEYS) for r in ranks)
    harmless = all(equal(r["plain/with"], r["plain/without"], KEYS + ("generated",)) for r in ranks)
    without = (ranks[0]["without"]["error"].split(" @ ")[0] if failed else
               f"trained ({ranks[0]['without'].get('error') or 'no error'}): the bug did not show")
    with_ = ("trained; losses and parameters equal the run without generation bit for bit" if fixed else
             "differs from the reference") + ("" if harmless else "; the plain model's run changed")
    return without, with_, failed and fixed and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
