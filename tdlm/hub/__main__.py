import sys

from tdlm.hub.pretrained import main

sys.exit(main())
