"""Run as another user (the tests' stranger) with the system Python: try to join a running srun
job's store knowing only what ``squeue`` shows. ``python3 stranger_probe.py HOST PORT KEYPORT``.

Prints one ``PROBE {json}`` line: the job ids squeue showed, and for every key a stranger can
compute from them whether the store let it in, and what ``unmunge`` said of the credential task 0's
key service hands out (when it is still open). ``authstore.py`` is copied beside this file.
"""

import json
import socket
import subprocess
import sys

import authstore  # the copy beside this file (standard library only)

host, port, key_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
jobs = subprocess.run(["squeue", "-h", "-o", "%i %u"], capture_output=True, text=True, timeout=30)
result = {"squeue": jobs.stdout.split(), "squeue_rc": jobs.returncode, "joined": [], "refused": []}
for job in result["squeue"][::2]:
    for step in ("0", "1"):
        for secret in (f"slurm:{job}:{job}.{step}", f"slurm:{job}:{job}.{step}.0", f"{job}.{step}", job):
            try:
                client = authstore.StoreClient(host, port, authstore.derive_key(secret), timeout=10)
                client.call(authstore.SET, [b"stranger", b"was here"])
                result["joined"].append(secret)
            except Exception as exc:  # noqa: BLE001 - any refusal counts
                result["refused"].append([secret, type(exc).__name__])
try:
    with socket.create_connection((host, key_port), timeout=10) as conn:
        cred = conn.makefile("rb").readline().strip()
    res = subprocess.run(["unmunge"], input=cred, capture_output=True, timeout=30)
    result["unmunge_rc"], result["unmunge"] = res.returncode, (res.stdout + res.stderr).decode(errors="replace")
except OSError as exc:
    result["key_service"] = f"{type(exc).__name__}: {exc}"
print("PROBE " + json.dumps(result), flush=True)
