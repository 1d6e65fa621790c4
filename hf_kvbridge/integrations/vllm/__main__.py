"""`python -m hf_kvbridge.integrations.vllm DIR ...`: `kvbridge serve`."""

import sys

from .serve import serve_main

if __name__ == "__main__":
    sys.exit(serve_main())
