"""botocore on an EC2 node: its region (IMDSv2, as botocore looks it up), the instance id
and the node role's credentials (the default credential chain, as any client does)."""
import os
import sys

import sdk_common as c

import botocore
import botocore.httpsession
import botocore.session
from botocore.utils import IMDSFetcher, InstanceMetadataRegionFetcher

c.check_version(botocore, "1.44.8")

# Observe every request botocore sends (it changes nothing).
_send = botocore.httpsession.URLLib3Session.send


def _observed(self, request):
    try:
        response = _send(self, request)
    except Exception:
        c.seen(request.method, request.url, None)
        raise
    c.seen(request.method, request.url, response.status_code)
    return response


botocore.httpsession.URLLib3Session.send = _observed


def user_agent(token):
    return f"Botocore/{botocore.__version__} gate-test/{token}"


def region(token):
    # The zone (`placement/availability-zone/`), less its last letter; a session token first.
    return InstanceMetadataRegionFetcher(user_agent=user_agent(token)).retrieve_region()


def instance_id(token):
    # botocore's own fetcher, its default retry rule (non-200 or empty: retry, 1 attempt).
    fetcher = IMDSFetcher(user_agent=user_agent(token))
    session_token = fetcher._fetch_metadata_token()
    try:
        return fetcher._get_request("latest/meta-data/instance-id", None, session_token).text
    except fetcher._RETRIES_EXCEEDED_ERROR_CLS:
        return None


def credentials(token):
    # The whole default chain; nothing but the instance metadata can answer here (the test
    # clears the environment and points HOME at an empty directory).
    session = botocore.session.get_session()
    session.user_agent_extra = f"gate-test/{token}"
    creds = session.get_credentials()
    return None if creds is None else f"{creds.method} {creds.access_key}"


ops = {}
for name in sys.argv[2:] or ["region", "instance_id", "credentials"]:
    c.run(ops, name, {"region": region, "instance_id": instance_id, "credentials": credentials}[name])
c.report(f"botocore {botocore.__version__}", ops)
