"""A torchrun script for the mapped-task tests: rank 0 prints its argument."""

import os
import sys

if os.environ["RANK"] == "0":
    print(f"script got {sys.argv[1]}", flush=True)
