"""python -m lazytrain_hf ... == lazytrain-hf ..."""
import sys

from .cli import main

sys.exit(main())
