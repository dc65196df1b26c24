"""``python -m zeroshim doctor | explain LOG | run CMD...``"""

import sys

from ._cli import main

sys.exit(main())
