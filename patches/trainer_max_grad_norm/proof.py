"""The judge of ``trainer_max_grad_norm`` (used by ``zeroshim prove`` and tests/test_trainer_max_grad_norm.py): the
HF Trainer with ``max_grad_norm=0.05`` and a ZeRO-2 config without ``gradient_clipping``, 2 ranks."""

from zeroshim._prove import equal, ranks_of

NAME = "trainer_max_grad_norm"
ARGS = ()
KEYS = ("clipping", "losses", "param_sha256")


def judge(ranks):
    """Proven: on every rank, without zeroshim DeepSpeed clipped at its own default and the run differs from the
    reference (the config that says "auto"); with zeroshim the clipping, the losses and the parameters equal the
    reference's bit for bit; and where max_grad_norm is DeepSpeed's default nothing changed.  In the accelerate
    loop, ``clip_grad_norm_(max_norm=0.05)`` under a config that clips at 1.0 was ignored (the run differs from the
    one whose config says 0.05); with zeroshim the run is the same bit for bit and rank 0 said so once, where
    without zeroshim nothing was said."""
    runs = ("reference", "without", "with", "default/without", "default/with", "accelerate/reference",
            "accelerate/without", "accelerate/with")
    if not ranks or not all(r[k].get("ok") for r in ranks for k in runs):
        return "a run failed", "a run failed", False
    r0 = ranks[0]
    ignored = all(r["without"]["clipping"] == r["deepspeed_default"] != r["reference"]["clipping"]
                  and not equal(r["without"], r["reference"], KEYS) for r in ranks)
    fixed = all(equal(r["with"], r["reference"], KEYS) for r in ranks)
    harmless = all(equal(r["default/with"], r["default/without"], KEYS) for r in ranks)
    accelerate_ignored = all(r["accelerate/without"]["clipping"] == 1.0 and
                             not equal(r["accelerate/without"], r["accelerate/reference"], KEYS) for r in ranks)
    told = all(equal(r["accelerate/with"], r["accelerate/without"], KEYS) and not r["accelerate/without"]["said"]
               for r in ranks) and len(r0["accelerate/with"]["said"]) == 1
    without = (f"clipped at DeepSpeed's default {r0['without']['clipping']:g}, not max_grad_norm "
               f"{r0['reference']['clipping']:g}" if ignored else "the bug did not show")
    with_ = ("clipped at max_grad_norm; losses and parameters equal the reference bit for bit" if fixed else
             "differs from the reference") + ("" if harmless else "; a run at DeepSpeed's default changed")
    without += ("; accelerate's clip_grad_norm_(0.05) ignored without a word" if accelerate_ignored else
                "; accelerate's clip_grad_norm_ was not shown ignored")
    with_ += ("; accelerate's ignored clip_grad_norm_ said at WARNING, numbers unchanged" if told else
              "; accelerate's ignored clip_grad_norm_ not said, or numbers changed")
    return without, with_, ignored and fixed and harmless and accelerate_ignored and told


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
