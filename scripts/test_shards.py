"""Deal the test files into N shards of about equal size (bytes of source, largest first, each
to the lightest shard) and print one line of paths per shard: gpu_check.sh's tests step runs
one pytest process per line. Usage: python scripts/test_shards.py N"""

import pathlib
import sys


def shards(n: int, root: pathlib.Path = pathlib.Path("tests")) -> list[list[str]]:
  if n < 1:
    raise SystemExit(f"test_shards.py: N must be a positive count, got {n}")
  dealt = [(0, []) for _ in range(n)]
  for f in sorted(root.glob("test_*.py"), key=lambda f: -f.stat().st_size):
    i = min(range(n), key=lambda i: dealt[i][0])
    dealt[i] = (dealt[i][0] + f.stat().st_size, dealt[i][1] + [str(f)])
  return [files for _, files in dealt if files]


if __name__ == "__main__":
  print("\n".join(" ".join(files) for files in shards(int(sys.argv[1]))))
