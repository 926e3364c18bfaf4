"""``python -m tdlm.demo``: the demo's entry point (``make demo``)."""

import sys

from tdlm.demo import main
from tdlm.errors import TDLMError

try:
    sys.exit(main())
except TDLMError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
