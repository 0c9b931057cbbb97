"""Launched by tests/core/runtime/test_launch.py. argv: SCRATCH_DIR MODE.

Every rank >= 1 starts a sleeping grandchild, writes "<own pid> <grandchild pid>" to
SCRATCH_DIR/pids.<rank> and sleeps. Rank 0, in MODE 'fail', waits until all those files exist
and exits with code 3; in MODE 'sleep' it writes its own file and sleeps like the others.
"""

import os
import subprocess
import sys
import time

scratch, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ['DIGEN_PROCESS_ID'])
world = int(os.environ['DIGEN_NUM_PROCESSES'])


def write_pids_and_sleep():
  grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])
  path = os.path.join(scratch, f'pids.{rank}')
  with open(path + '.tmp', 'w') as f:
    f.write(f'{os.getpid()} {grandchild.pid}\n')
  os.replace(path + '.tmp', path)  # atomic: readers never see a half-written file
  print('sleeping', flush=True)
  time.sleep(120)
  sys.exit(0)


if rank > 0 or mode == 'sleep':
  write_pids_and_sleep()
deadline = time.time() + 60
while time.time() < deadline and not all(
    os.path.exists(os.path.join(scratch, f'pids.{r}')) for r in range(1, world)
):
  time.sleep(0.05)
print('failing with 3', flush=True)
sys.exit(3)
