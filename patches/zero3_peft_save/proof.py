"""The judge of patch ``zero3_peft_save`` (shared by its test and ``zeroshim prove``).

Proven: without zeroshim a ZeRO-3 save wrote the adapter without its weights (HF Trainer:
no tensors, transformers < 5; custom loop: [0]-shaped placeholders), and with zeroshim,
on every rank, the Trainer's adapter equals the ZeRO-3 16-bit-gather save bit for bit,
the custom loop's equals the gathered save bit for bit, and a save on rank 0 alone was
refused with zeroshim's error instead of written.
"""

NAME = "zero3_peft_save"
ARGS = ()
REFUSAL = "zeroshim[zero3_peft_save]: refusing to save a peft adapter under DeepSpeed ZeRO-3"


def empty(saved) -> bool:
    """Written with no tensors at all."""
    return bool(saved.get("written")) and not saved.get("shapes")


def placeholders(saved) -> bool:
    """Written with [0]-shaped (or otherwise empty) tensors."""
    return bool(saved.get("written")) and any(0 in shape or not shape for shape in saved.get("shapes", {}).values())


def whole(saved) -> bool:
    return bool(saved.get("written")) and bool(saved.get("shapes")) and not placeholders(saved)


def _describe(saved) -> str:
    if not saved.get("written"):
        return "nothing written" + (f" ({saved['error'][:60]}...)" if saved.get("error") else "")
    if empty(saved):
        return "no tensors"
    if placeholders(saved):
        return f"{len(saved['shapes'])} tensors of shape [0]"
    return f"{len(saved['shapes'])} whole tensors"


def judge(ranks):
    without_bug, with_ok = True, True
    said_without = said_with = ""
    for rank in ranks:
        ref, out, fix = rank["reference"], rank["without"], rank["with"]
        if not (ref.get("ok") and out.get("ok") and fix.get("ok")):
            return ("a run failed", "a run failed", False)
        trainer_bug = empty(out["trainer"])
        custom_bug = placeholders(out["custom"]["every_rank"]) or placeholders(out["custom"]["rank0_only"])
        without_bug = without_bug and (trainer_bug or custom_bug)
        with_ok = with_ok and (
            whole(fix["trainer"]) and fix["trainer"]["sha256"] == ref["trainer"]["sha256"]
            and whole(fix["custom"]["every_rank"])
            and fix["custom"]["every_rank"]["sha256"] == fix["custom"]["every_rank_by_hand"]["sha256"]
            and not fix["custom"]["rank0_only"].get("written")
            and (rank is not ranks[0] or REFUSAL in fix["custom"]["rank0_only"].get("error", "")))
        if rank is ranks[0]:
            said_without = (f"Trainer.save_model: {_describe(out['trainer'])}; save_pretrained on every rank: "
                            f"{_describe(out['custom']['every_rank'])}, on rank 0 alone: "
                            f"{_describe(out['custom']['rank0_only'])}")
            said_with = (f"Trainer.save_model: {_describe(fix['trainer'])} (= the 16-bit-gather save: "
                         f"{fix['trainer'].get('sha256') == ref['trainer'].get('sha256')}); save_pretrained on every "
                         f"rank: {_describe(fix['custom']['every_rank'])} (= gathered save: "
                         f"{fix['custom']['every_rank'].get('sha256') == fix['custom']['every_rank_by_hand'].get('sha256')}), "
                         f"on rank 0 alone: {'refused' if REFUSAL in fix['custom']['rank0_only'].get('error', '') else _describe(fix['custom']['rank0_only'])}")
    return said_without, said_with, bool(without_bug and with_ok)


def prove(launch, out, nproc, device):
    from zeroshim._prove import ranks_of

    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
