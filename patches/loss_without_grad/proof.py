"""The judge of ``loss_without_grad`` (used by ``zeroshim prove`` and tests/test_loss_without_grad.py):
LoRA-shaped blocks under reentrant checkpointing with inputs that need no grad, ZeRO-2 and ZeRO-3.

Proven: without zeroshim every rank failed with DeepSpeed's (or torch's) message, which
does not name the cause; with zeroshim with zeroshim's error, which names reentrant
checkpointing without input grads (counted) and its remedy; a detached loss gets the
error without that cause; and the remedy trains to the same numbers with and without
zeroshim, bit for bit."""

from zeroshim._prove import equal, first_line, shows_bug

NAME = "loss_without_grad"
ARGS = ()
OURS = "zeroshim[loss_without_grad]: engine.backward(loss) got a loss that does not require grad"
CAUSE = "(1) reentrant activation checkpointing"


def judge(ranks):
    without_ok = with_ok = True
    for rank in ranks:
        for stage in (2, 3):
            out, fix = rank[f"z{stage}/without"], rank[f"z{stage}/with"]
            detached = rank[f"z{stage}/detached/with"]
            without_ok &= not out["ok"] and shows_bug(NAME, out.get("error")) and OURS not in out["error"]
            with_ok &= (not fix["ok"] and OURS in fix["error"] and CAUSE in fix["error"]
                        and "LossWithoutGradError" in fix["error"]
                        and not detached["ok"] and OURS in detached["error"] and CAUSE not in detached["error"]
                        and equal(rank[f"z{stage}/remedy/with"], rank[f"z{stage}/remedy/without"]))
    first = ranks[0]
    said_without = first_line(first["z3/without"].get("error")) if not first["z3/without"]["ok"] else "trained"
    said_with = ("zeroshim's error naming reentrant checkpointing without input grads and the remedy; the remedy "
                 "trains to the same numbers both ways" if with_ok else
                 f"not as expected: {first_line(first['z3/with'].get('error')) or 'trained'}")
    return said_without, said_with, bool(without_ok and with_ok)


def prove(launch, out, nproc, device):
    from zeroshim._prove import ranks_of

    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
