"""An Azure VM's workload with Python's urllib (no Azure SDK): the location from the instance
metadata, and a managed-identity token, asked as azure-identity asks it (resource
percent-encoded, api-version 2018-02-01) and with a resource that needs no encoding."""
import sys
import urllib.error
import urllib.parse
import urllib.request

import sdk_common as c

IMDS = "http://169.254.169.254"
# No proxy, whatever the environment says.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(token, path, params):
    url = f"{IMDS}{path}?{urllib.parse.urlencode(params)}"
    req = urllib.request.Request(url, headers={"Metadata": "true", "X-Probe-Token": token})
    try:
        with OPENER.open(req, timeout=5) as r:
            c.seen("GET", url, r.status)
            return r.read().decode()
    except urllib.error.HTTPError as e:
        c.seen("GET", url, e.code)
        raise RuntimeError(f"HTTP {e.code}: {e.read().decode(errors='replace').strip()}") from None
    except Exception:
        c.seen("GET", url, None)
        raise


def location(token):
    params = {"api-version": "2021-02-01", "format": "text"}
    return get(token, "/metadata/instance/compute/location", params)


def access_token(token):
    params = {"api-version": "2018-02-01", "resource": "https://management.azure.com/"}
    return get(token, "/metadata/identity/oauth2/token", params)


def access_token_plain(token):
    # The same path with a resource that needs no percent-encoding.
    params = {"api-version": "2018-02-01", "resource": "management.azure.com"}
    return get(token, "/metadata/identity/oauth2/token", params)


ops = {}
fns = {"location": location, "token": access_token, "token_plain": access_token_plain}
for name in sys.argv[2:] or list(fns):
    c.run(ops, name, fns[name])
c.report(f"urllib {sys.version.split()[0]}", ops)
