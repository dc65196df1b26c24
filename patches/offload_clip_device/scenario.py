"""Scenario for patch ``offload_clip_device``: ZeRO-3 + optimizer/param offload
to the CPU + gradient clipping that fires (``gradient_clipping: 1e-6``).

``--device cpu`` (CI): trains with and without zeroshim (on the CPU the norm
is already a CPU tensor, so both must train and be identical), and calls the
real ``unscale_and_clip_grads`` of the live optimizer with the norm on a CUDA
device simulated by torch's FakeTensorMode, which applies torch's real
device-propagation rules without a GPU.

``--device cuda`` (gpu marker): the real thing, three modes in one process per
rank: offload without zeroshim, offload with zeroshim, and a reference without
offload (fp32 partitions on the GPU, so no mismatch).
"""

import argparse

import torch
import torch.nn as nn

from common import (attempt, describe, enable_zeroshim, end, import_deepspeed, init_distributed, param_digest, versions)

deepspeed = import_deepspeed()
STEPS = 3


def config(offload: bool) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 1000}
    if offload:
        zero.update(offload_optimizer={"device": "cpu", "pin_memory": False},
                    offload_param={"device": "cpu", "pin_memory": False})
    return {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "gradient_clipping": 1e-6,  # every step clips
        "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": zero, "steps_per_print": 10**9,
    }


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def engine_for(offload: bool):
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=m, optimizer=opt, config=config(offload))
    return engine


def batches(device):
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    for _ in range(STEPS):
        x = torch.randn(4, 32, generator=gen)
        y = torch.randn(4, 8, generator=gen)
        yield x.to(device, torch.bfloat16), y.to(device)


def train(device, offload: bool) -> dict:
    engine = engine_for(offload)
    losses, norms = [], []
    for x, y in batches(device):
        loss = (engine(x).float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        norms.append(float(norm))
    return {"losses": losses, "grad_norms": norms, **param_digest(engine, values=True)}


def fake_cuda_unscale(device) -> dict:
    """Call the live optimizer's real unscale_and_clip_grads with the norm on a
    (fake) CUDA device and the fp32 gradient partition on the CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    engine = engine_for(offload=True)
    x, y = next(batches(device))
    engine.backward((engine(x).float() - y).pow(2).mean())
    opt = engine.optimizer
    grad = opt.fp32_partitioned_groups_flat[0].grad
    if grad is None:  # some releases attach the fp32 grad only inside step()
        opt._prepare_sub_group(0, set())
        grad = opt.fp32_partitioned_groups_flat[0].grad
    before = grad.clone()
    with FakeTensorMode(allow_non_fake_inputs=True):
        norm = torch.tensor(1e3, device="cuda")  # large: clipping fires
        try:
            opt.unscale_and_clip_grads(0, norm)
            outcome = {"ok": True}
        except Exception as exc:
            outcome = {"ok": False, "error": describe(exc)}
    outcome["grad_device"] = str(grad.device)
    outcome["real_grad_untouched"] = bool(torch.equal(before, grad))
    return outcome


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--uncaught", action="store_true", help="train once with offload, let errors propagate "
                                                                "(to capture a real log)")
    args = parser.parse_args()
    init_distributed()
    device = torch.device(args.device, torch.distributed.get_rank()) if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(device)
    if args.uncaught:
        print(train(device, True)["losses"])
        return
    results = {"versions": versions()}
    results["without/offload"] = attempt(train, device, True)
    if args.device == "cpu":
        results["without/fake_cuda_norm"] = fake_cuda_unscale(device)
    else:
        results["reference/no_offload"] = attempt(train, device, False)
    zeroshim = enable_zeroshim()
    results["status"] = {k: v.as_dict() for k, v in zeroshim.status().items()}
    results["with/offload"] = attempt(train, device, True)
    if args.device == "cpu":
        # The wrapper on the real method; forced on where the version gate says
        # "not affected" (there the norm function already returns a CPU norm).
        zeroshim.configure(offload_clip_device="on")
        results["forced_status"] = zeroshim.status()["offload_clip_device"].as_dict()
        results["with/fake_cuda_norm"] = fake_cuda_unscale(device)
        zeroshim.reset_overrides()
    end(args.out, results)


if __name__ == "__main__":
    main()
