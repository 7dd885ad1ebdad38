"""What the SDK scripts share: each runs named operations, times them, records every HTTP
request the SDK sends (method, path, status), and prints one JSON line:

    {"sdk": "botocore 1.44.8", "ops": {NAME: {"token", "value", "error", "requests",
     "elapsed_ms"}}}

Every request of operation NAME carries the token `PREFIX-NAME.end` (PREFIX is the script's
only argument) in its User-Agent or an X-Probe-Token header, so the test can tell what reached
the fake metadata service. The scripts run only as workloads of the privileged tests (inside
the test network namespace and cgroup, entered before Python starts), never on a host.
"""
import json
import sys
import time
from urllib.parse import urlsplit

PREFIX = sys.argv[1] if len(sys.argv) > 1 else ""
_current = None


def token(name):
    return f"{PREFIX}-{name}.end"


def check_version(module, want):
    """The pinned SDK, never another one the machine may have."""
    have = getattr(module, "__version__", None)
    if have != want:
        sys.exit(f"{module.__name__} {have} from {getattr(module, '__file__', '?')}: want {want}")


def seen(method, url, status):
    """Record one HTTP request of the operation running (status None: no response)."""
    if _current is not None:
        parts = urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        _current["requests"].append([method, target, status])


def run(ops, name, fn):
    """Run fn(token) as operation `name`; its return value is the operation's value."""
    global _current
    out = {"token": token(name), "value": None, "error": None, "requests": []}
    _current = out
    start = time.monotonic()
    try:
        out["value"] = fn(out["token"])
    except Exception as e:  # what the SDK raised is the result
        out["error"] = f"{type(e).__name__}: {e}"[:400]
    out["elapsed_ms"] = round((time.monotonic() - start) * 1000, 1)
    _current = None
    ops[name] = out


def report(sdk, ops):
    print(json.dumps({"sdk": sdk, "ops": ops}), flush=True)
