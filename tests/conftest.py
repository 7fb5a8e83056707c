import os
import sys

# Shared test helpers (prompts.py, e2e/server.py) import by plain module name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
