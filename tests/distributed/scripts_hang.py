"""Worker for tests/distributed/test_launch.py: records its pid under --root, then hangs."""

import argparse
import os
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--root", required=True)
a = p.parse_args()
Path(a.root, f"pid_{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(3600)
