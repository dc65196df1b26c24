"""See torchvision/__init__.py of this stand-in: names exist, using them raises."""


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision stand-in (tests/clients/xtuner_stubs): image transforms are not available")


Compose = Lambda = Resize = ToTensor = Normalize = CenterCrop = RandomResizedCrop = _Unavailable
