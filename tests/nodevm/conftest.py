"""The node VM's own tests run only inside the guest (``NODEVM_GUEST=1``, set by
``guest/run.sh``): they drive the edged.service installed there. Elsewhere they are not
collected (there is no installed service to test), which keeps the default suite free of
skips; the pieces of the host side (``report``) are tested everywhere."""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("NODEVM_GUEST") == "1" else ["test_node_service.py"]
