"""`python tests/serve/fake_serve.py MODEL_DIR --port P [...]`: the real server over FakeEngine.

Used by the server tests when the real engine is not importable (or LOWBIT_SERVE_FAKE=1).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine  # noqa: E402

from lowbit.runtime.server.app import ServerConfig, serve  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--api-key")
    ap.add_argument("--served-model-name")
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--max-queue", type=int, default=256)
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--load-delay", type=float, default=1.0)
    ap.add_argument("--step-delay", type=float, default=0.002)
    args = ap.parse_args()

    def build():
        time.sleep(args.load_delay)
        return FakeEngine(args.model, max_num_seqs=args.max_running, max_model_len=args.max_model_len,
                          step_delay=args.step_delay)

    config = ServerConfig(model_name=args.served_model_name or args.model, port=args.port, api_key=args.api_key,
                          max_running=args.max_running, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                          shutdown_timeout=10)
    serve(config, build)


if __name__ == "__main__":
    main()
