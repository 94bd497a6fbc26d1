"""python -m tools.build_models: builds the model repository (see repository.py)."""

import sys

from tools.build_models.repository import main

sys.exit(main())
