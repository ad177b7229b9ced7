"""First look at PyTorch's default (graph API) cuDNN path under the shim, on a GPU.

1. cuDNN's own API log (CUDNN_LOGLEVEL_DBG=3) of one small convolution's forward and backward,
   without the shim: which backend descriptors and attributes PyTorch really sets.
2. One ResNet-50 training step (N=32, fp32) under the shim with recording, a 64 MiB limit and
   the debug log: how many kernels were keyed and recorded, why others were not, how many
   execution plans the limit refused.

    python -m benchmarks.graph_smoke --out DIR
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

CONV = """
import torch
torch.manual_seed(0)
conv = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()
x = torch.randn(8, 16, 20, 20, device="cuda", requires_grad=True)
conv(x).sum().backward()
torch.cuda.synchronize()
print("ok")
"""

STEP = """
import torch, torchvision
model = torchvision.models.resnet50().cuda()
x = torch.randn(32, 3, 224, 224, device="cuda")
loss = model(x).sum()
loss.backward()
torch.cuda.synchronize()
print("loss", loss.item())
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDNN_V8_API_DISABLED"}

    api_log = out / "cudnn_api.log"
    proc = subprocess.run([sys.executable, "-c", CONV], capture_output=True, text=True,
                          env=dict(env, CUDNN_LOGLEVEL_DBG="3", CUDNN_LOGDEST_DBG=str(api_log)))
    print("conv without shim:", proc.returncode, proc.stdout.strip(), proc.stderr[-500:])
    text = api_log.read_text(errors="replace") if api_log.exists() else ""
    calls = collections.Counter(re.findall(r"Function (cudnn\w+)", text))
    print("cuDNN API calls:", dict(calls.most_common()))
    attrs = collections.Counter(re.findall(r"(CUDNN_ATTR_\w+)", text))
    print("attributes named:", dict(attrs.most_common(60)))

    record, log = out / "smoke.record", out / "smoke-shim.log"
    for path in (record, log):
        path.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "mucudnn", "record", "-o", str(record),
                           "--workspace-limit", "64MiB", "--", sys.executable, "-c", STEP],
                          capture_output=True, text=True,
                          env=dict(env, MUCUDNN_LOG_LEVEL="debug", MUCUDNN_LOG_FILE=str(log),
                                   MUCUDNN_SUMMARY="1"))
    print("resnet50 step under the shim:", proc.returncode, proc.stdout.strip()[-300:])
    print(proc.stderr[-1500:])
    kernels = [line for line in record.read_text().splitlines() if line.startswith("kernel")] \
        if record.exists() else []
    dirs = collections.Counter(line.split()[1].split(",")[0] for line in kernels)
    print("recorded kernels:", len(kernels), dict(dirs))
    shim_log = log.read_text(errors="replace") if log.exists() else ""
    print("no-key reasons:", dict(collections.Counter(
        re.findall(r"graph convolution without a kernel key: ([^;]+);", shim_log))))
    print("plans refused by the limit:", shim_log.count("over the limit"))
    print("errors/warnings:", [l for l in shim_log.splitlines() if "error" in l or "warning" in l][:10])
    return 0


if __name__ == "__main__":
    sys.exit(main())
