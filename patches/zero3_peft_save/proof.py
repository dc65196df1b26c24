"""The judge of patch ``zero3_peft_save`` (shared by its test and ``zeroshim prove``).

Proven: without zeroshim a ZeRO-3 save wrote the adapter without its weights (HF Trainer:
no tensors, transformers < 5; with the vocabulary resized, transformers >= 5 leaves out the
embeddings peft saves; custom loop: [0]-shaped placeholders), and with zeroshim,
on every rank, the Trainer's adapter equals the ZeRO-3 16-bit-gather save bit for bit
(resized: a by-hand gather's save, with and without the 16-bit gather),
the custom loop's equals the gathered save bit for bit; a save on rank 0 alone, which
cannot be gathered, writes peft's file and its check reports the placeholders (ERROR);
and OpenRLHF's save (rank 0 alone, then its own gathered file over peft's) ends with the
same whole adapter as the gathered save, checked as replaced.
"""

NAME = "zero3_peft_save"
ARGS = ()

def verdicts(saved) -> list:
    return [v["verdict"] for v in saved.get("check", [])]


def empty(saved) -> bool:
    """Written with no tensors at all."""
    return bool(saved.get("written")) and not saved.get("shapes")


def placeholders(saved) -> bool:
    """Written with [0]-shaped (or otherwise empty) tensors."""
    return bool(saved.get("written")) and any(0 in shape or not shape for shape in saved.get("shapes", {}).values())


def whole(saved) -> bool:
    return bool(saved.get("written")) and bool(saved.get("shapes")) and not placeholders(saved)


def elements(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def lost_embeddings(saved, whole_save) -> bool:
    """Written with every tensor of ``whole_save`` but the embeddings (which peft said it saves)."""
    if not (saved.get("written") and whole_save.get("written")) or placeholders(saved):
        return False
    missing = set(whole_save.get("shapes", {})) - set(saved.get("shapes", {}))
    return bool(missing) and all("embed_tokens" in k or "lm_head" in k for k in missing) and set(
        saved["shapes"]) < set(whole_save["shapes"])


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
        trainer_bug = empty(out["trainer"]) or empty(out["resized_off"]) or lost_embeddings(
            out["resized_off"], fix["resized_off"])
        custom_bug = placeholders(out["custom"]["every_rank"]) or placeholders(out["custom"]["rank0_only"])
        without_bug = without_bug and (trainer_bug or custom_bug)
        resized_ok = all(whole(fix[case]) and fix[case].get("ok") and fix[case]["sha256"] == fix[case]["by_hand"]["sha256"]
                         for case in ("resized_off", "resized_on"))
        with_ok = with_ok and resized_ok and (
            whole(fix["trainer"]) and fix["trainer"]["sha256"] == ref["trainer"]["sha256"]
            and whole(fix["custom"]["every_rank"])
            and fix["custom"]["every_rank"]["sha256"] == fix["custom"]["every_rank_by_hand"]["sha256"]
            and placeholders(fix["custom"]["rank0_only"])
            and verdicts(fix["custom"]["rank0_only"]) == (["placeholders"] if rank is ranks[0] else [])
            and whole(fix["custom"]["rank0_overwrite"])
            and fix["custom"]["rank0_overwrite"]["sha256"] == fix["custom"]["every_rank_by_hand"]["sha256"]
            and verdicts(fix["custom"]["rank0_overwrite"]) == (["replaced"] if rank is ranks[0] else [])
            and not fix["custom"]["rank1_only"].get("written")
            and fix["custom"]["both_main"].get("sha256") == fix["custom"]["every_rank_by_hand"]["sha256"])
        if rank is ranks[0]:
            said_without = (f"Trainer.save_model: {_describe(out['trainer'])}, with the vocabulary resized: "
                            f"{_describe(out['resized_off'])}"
                            f"{' (the embeddings left out)' if lost_embeddings(out['resized_off'], fix['resized_off']) else ''}"
                            f"; save_pretrained on every rank: "
                            f"{_describe(out['custom']['every_rank'])}, on rank 0 alone: "
                            f"{_describe(out['custom']['rank0_only'])}")
            said_with = (f"Trainer.save_model: {_describe(fix['trainer'])} (= the 16-bit-gather save: "
                         f"{fix['trainer'].get('sha256') == ref['trainer'].get('sha256')}), with the vocabulary "
                         f"resized: {_describe(fix['resized_off'])} (= a by-hand gather's save, both gather settings: "
                         f"{resized_ok}); save_pretrained on every "
                         f"rank: {_describe(fix['custom']['every_rank'])} (= gathered save: "
                         f"{fix['custom']['every_rank'].get('sha256') == fix['custom']['every_rank_by_hand'].get('sha256')}), "
                         f"on rank 0 alone: {_describe(fix['custom']['rank0_only'])}, checked: "
                         f"{verdicts(fix['custom']['rank0_only'])}; OpenRLHF's save: "
                         f"{_describe(fix['custom']['rank0_overwrite'])}, checked: "
                         f"{verdicts(fix['custom']['rank0_overwrite'])}")
    return said_without, said_with, bool(without_bug and with_ok)


def prove(launch, out, nproc, device):
    from zeroshim._prove import ranks_of

    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
