"""The tiny MLP and dataset the HF Trainer reproductions share (``trainer_max_grad_norm``,
``zero_optimizer_defaults``): a 16 -> 32 -> 4 MLP whose forward returns ``{"loss": ...}`` (the mean square of its
output), seeded in its constructor, and rows of 16 random features from a fixed generator."""

import torch
import torch.nn as nn

H = 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, 4))

    def forward(self, x):
        return {"loss": self.net(x).pow(2).mean()}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, H, generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i]}
