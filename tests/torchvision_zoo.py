"""torchvision's image classifiers, the models a user tries a planner on first, for the
conformance tests (tests/test_torchvision.py) and the whole table
(benchmarks/torchvision_zoo.py). Each covers a way CNNs break executors: in-place
activations after a tensor-parallel layer (`ReLU(inplace=True)` in AlexNet and VGG,
`Hardswish(inplace=True)` in MobileNetV3), residual adds (ResNet, RegNet), concatenation
(DenseNet, Inception), channel shuffles (`view`/`transpose`: ShuffleNet), squeeze-excitation
and stochastic depth (EfficientNet), two outputs in training (Inception-v3's auxiliary
classifier) and windowed attention (Swin). The smallest width of each family, 8 rows of 64
pixels (Inception-v3: 2 rows of 299, the least its auxiliary classifier takes), random
init, dropout and stochastic depth off, in float64: a ReLU turns float32's reassociation
(a row-split Linear sums two halves) into a different gradient wherever a pre-activation
lies within rounding of zero, and VGG-11's tensor plan met one (a value of 1.3e-7 in its
second Linear's output: 3e-4 apart in that layer's gradient after one step, in one process
too when its first Linear's sum is split the same way); float64 leaves such kinks to the
16th digit, so what the comparison sees is the executor.

How torchvision is loaded (`torchvision_models`): PyPI's torchvision wheels for Linux are
CUDA builds, and beside the CPU torch this project installs, `import torchvision` raises
("operator torchvision::nms does not exist": its `_meta_registrations` registers fake
kernels for compiled ops that did not load). Worse, merely *installed*, it breaks every
Hugging Face model: transformers sees the package and imports it from
`transformers.image_utils`. So it is not a dependency of the `test` extra. The model
definitions are plain Python and use none of the compiled ops; this helper takes them from
the release built against torch 2.13.0 (`TORCHVISION`), fetched once with pip into a
cache of its own (the Python files only), and imports them there with the fake-kernel
registrations left out. A torchvision that is already installed is used instead (on a
machine whose torch it matches; its registrations left out too where its ops do not load).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

from zoo import CLASSES, ZooModel

TORCHVISION = "0.28.0"  # the release built against torch 2.13.0 (`Requires-Dist: torch==2.13.0`)
ROWS, IMAGE = 8, 64
DTYPE = torch.float64
# Inception-v3's auxiliary classifier pools Mixed_6e's output 5x5 stride 3, then convolves
# 5x5: 17x17 at least, which 299 pixels give (75 suffice without it); 2 rows keep it cheap
INCEPTION_ROWS, INCEPTION_IMAGE = 2, 299


def torchvision_models() -> types.ModuleType:
    """`torchvision.models`, importable beside this CPU torch (see the module docstring)."""
    if "torchvision.models" in sys.modules:
        return sys.modules["torchvision.models"]
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        # on sys.path for this import only: processes started later (spawned ranks inherit
        # sys.path) would otherwise find it from transformers and import it, for nothing
        folder = str(_unpacked())
        sys.path.insert(0, folder)
        try:
            import torchvision.models
        finally:
            sys.path.remove(folder)
        return torchvision.models
    if not _ops_load(Path(spec.origin).parent):
        # fake kernels of compiled ops that are not there; no model definition reads them
        name = "torchvision._meta_registrations"
        sys.modules[name] = types.ModuleType(name)
    import torchvision.models

    return torchvision.models


def _ops_load(package: Path) -> bool:
    """Whether an installed torchvision's compiled ops load beside this torch."""
    library = next(package.glob("_C*.so"), None) or next(package.glob("_C*.pyd"), None)
    if library is None:
        return False
    try:
        torch.ops.load_library(str(library))
        return True
    except (OSError, RuntimeError):
        return False


_META_REGISTRATIONS = "torchvision/_meta_registrations.py"


def _unpacked() -> Path:
    """A folder holding torchvision `TORCHVISION`'s Python files, fetched with pip once per
    cache (`HYPLAN_TORCHVISION_DIR`, default ~/.cache/hyplan): the CUDA wheel's compiled
    parts are left in the wheel, and so are the fake kernels registered for them. Made in a temporary folder and renamed, so two test
    workers fetching it at once both end with a whole copy."""
    cache = Path(os.environ.get("HYPLAN_TORCHVISION_DIR",
                                Path.home() / ".cache" / "hyplan")) / f"torchvision-{TORCHVISION}"
    if (cache / "torchvision" / "models" / "__init__.py").exists():
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache.parent) as work:
        # --no-deps: its one dependency that matters, torch==2.13.0, is the torch installed
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "-q", "-d", work, f"torchvision=={TORCHVISION}"],
            capture_output=True, text=True)
        wheels = list(Path(work).glob("torchvision-*.whl"))
        if fetched.returncode != 0 or not wheels:
            raise ImportError(f"torchvision=={TORCHVISION} could not be fetched with pip "
                              f"(exit {fetched.returncode}): {fetched.stderr.strip()[-300:]}; "
                              f"the torchvision tests need PyPI or HYPLAN_TORCHVISION_DIR "
                              f"holding torchvision-{TORCHVISION}/torchvision/")
        unpacked = Path(work) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(unpacked, [n for n in wheel.namelist()
                                        if n.startswith("torchvision/") and n.endswith(".py")
                                        and n != _META_REGISTRATIONS])
        (unpacked / _META_REGISTRATIONS).write_text(
            '"""Left empty by hyplan\'s tests/torchvision_zoo.py: the fake kernels of compiled '
            'ops this copy does not hold."""\n')
        try:
            unpacked.rename(cache)
        except OSError:  # another worker renamed its copy first
            pass
    return cache


def _images(step: int, rows: int = ROWS, size: int = IMAGE) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(rows, 3, size, size, generator=g, dtype=DTYPE),
            torch.randint(0, CLASSES, (rows,), generator=g))


def _inception_images(step: int) -> tuple:
    return _images(step, INCEPTION_ROWS, INCEPTION_IMAGE)


def class_loss(output, target):
    return F.cross_entropy(output, target)


def inception_loss(output, target):
    """torchvision's reference training loss for Inception-v3 (references/classification):
    the main logits' cross-entropy plus 0.4 times the auxiliary classifier's, both outputs
    of its training forward (`InceptionOutputs`) taking part."""
    logits, aux = output
    return F.cross_entropy(logits, target) + 0.4 * F.cross_entropy(aux, target)


def _tv(builder: str, **kwargs):
    """A seeded builder of torchvision.models.`builder`(num_classes=CLASSES, **kwargs), its
    stochastic depth off (random per call, so no two runs could agree; swin_t fixes its
    rate, so it is set on the modules)."""
    def make():
        torch.manual_seed(0)
        model = getattr(torchvision_models(), builder)(num_classes=CLASSES, **kwargs)
        for module in model.modules():
            if type(module).__name__ == "StochasticDepth":
                module.p = 0.0
        return model.to(DTYPE).train()
    return make


TORCHVISION_ZOO: dict[str, ZooModel] = {m.name: m for m in [
    # Linear, ReLU(inplace=True), Linear: the in-place activation after a tensor-parallel layer
    ZooModel("alexnet", _tv("alexnet", dropout=0.0), _images, class_loss),
    ZooModel("vgg11", _tv("vgg11", dropout=0.0), _images, class_loss),
    ZooModel("resnet18", _tv("resnet18"), _images, class_loss),
    ZooModel("densenet121", _tv("densenet121"), _images, class_loss),
    # Hardswish(inplace=True) after its classifier's first Linear; squeeze-excitation
    ZooModel("mobilenet_v3_small", _tv("mobilenet_v3_small", dropout=0.0), _images, class_loss),
    ZooModel("efficientnet_b0", _tv("efficientnet_b0", dropout=0.0), _images, class_loss),
    ZooModel("shufflenet_v2_x0_5", _tv("shufflenet_v2_x0_5"), _images, class_loss),
    ZooModel("regnet_x_400mf", _tv("regnet_x_400mf"), _images, class_loss),
    # two outputs in training: the logits and the auxiliary classifier's
    ZooModel("inception_v3", _tv("inception_v3", dropout=0.0, aux_logits=True,
                                 init_weights=True),
             _inception_images, inception_loss),
    ZooModel("swin_t", _tv("swin_t"), _images, class_loss),
]}
