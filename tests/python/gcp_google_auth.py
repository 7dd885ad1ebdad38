"""google-auth on a GCE node: whether it detects the metadata server (ping, is_on_gce), the
project id and the zone, and the default service account's access token (compute_engine
.Credentials, and the token path itself).

google-auth reads the metadata host from GCE_METADATA_HOST (metadata.google.internal by
default, a name this test's network cannot resolve): the test sets it to 169.254.169.254.
Its detection ping goes to GCE_METADATA_IP, 169.254.169.254 by default."""
import sys

import sdk_common as c

import google.auth
import google.auth.transport.requests
import requests
from google.auth import compute_engine
from google.auth.compute_engine import _metadata

c.check_version(google.auth, "2.63.0")
c.check_version(requests, "2.34.2")


class Session(requests.Session):
    """A requests session that tags every request with the operation's token and records it."""

    def __init__(self, token):
        super().__init__()
        self.headers["X-Probe-Token"] = token

    def request(self, method, url, *args, **kwargs):
        try:
            response = super().request(method, url, *args, **kwargs)
        except Exception:
            c.seen(method, url, None)
            raise
        c.seen(method, url, response.status_code)
        return response


def transport(token):
    return google.auth.transport.requests.Request(session=Session(token))


def ping(token):
    # How google.auth.default() tells it runs on GCE: GET / with Metadata-Flavor, and a 200
    # that carries Metadata-Flavor: Google back.
    return _metadata.ping(transport(token))


def is_on_gce(token):
    # google.auth.default()'s own question: the ping above, then (on Linux) the DMI product
    # name, which no test machine has as "Google".
    return _metadata.is_on_gce(transport(token))


def v1_root(token):
    # The v1 root's listing (names only), as a client asks it to see the server answer.
    return _metadata.get(transport(token), "")


def v1_recursive(token):
    # The same root with recursive=true: the whole tree, credentials' names included.
    return _metadata.get(transport(token), "", recursive=True)


def project_id(token):
    return _metadata.get_project_id(transport(token))


def zone(token):
    return _metadata.get(transport(token), "instance/zone")


def access_token(token):
    creds = compute_engine.Credentials()
    creds.refresh(transport(token))
    return creds.token


def token_path(token):
    # The default account's token path itself (Credentials asks for the account first).
    return _metadata.get(transport(token), "instance/service-accounts/default/token")


ops = {}
fns = {
    "ping": ping,
    "is_on_gce": is_on_gce,
    "v1_root": v1_root,
    "v1_recursive": v1_recursive,
    "project_id": project_id,
    "zone": zone,
    "token": access_token,
    "token_path": token_path,
}
for name in sys.argv[2:] or list(fns):
    c.run(ops, name, fns[name])
c.report(f"google-auth {google.auth.__version__}", ops)
