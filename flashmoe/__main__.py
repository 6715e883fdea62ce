"""`python -m flashmoe` is the `flashmoe` command."""

import sys

from flashmoe.cli import main

sys.exit(main())
