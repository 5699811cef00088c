"""Serve a model sharded over a device mesh behind the OpenAI-compatible HTTP API.

    python examples/serve_on_a_mesh.py [--model meta-llama/Llama-3.1-8B-Instruct] \
        [--draft yuhuili/EAGLE3-LLaMA3.1-Instruct-8B | --no-draft] [--tp 8] [--dp 1] \
        [--port 8000] [--num-slots 8] [--capacity 1024] [--keep-serving]

On 8 GPUs or 8 TPU chips, `--tp 8` splits attention heads, the MLP and the vocabulary over
them (tensor parallel; `--dp` splits the batch's rows). Each weight is read straight into
its slice of the mesh, the draft head is replicated beside it, and the continuous-batching
engine decodes every request over the whole mesh. The script builds that server in-process,
sends it one chat request as any OpenAI client would, prints the answer and stops cleanly
(`--keep-serving`: serve until Ctrl-C after that first answer). The command-line server
does the same:

    eaglejax serve --model meta-llama/Llama-3.1-8B-Instruct \
        --draft yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --tp 8 --port 8000

Try it on a CPU with simulated devices (what CI runs, on a tiny random model):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/serve_on_a_mesh.py \
        --model smollm2-135m-instruct --no-draft --tp 3 --capacity 256
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import uvicorn

import eaglejax
from eaglejax.serving.engine import Engine
from eaglejax.serving.server import create_app


def ask(url: str, model: str, question: str, max_tokens: int) -> dict:
    """One request to /v1/chat/completions, as `openai.OpenAI(base_url=url + "/v1")`'s
    `client.chat.completions.create(...)` would send it (here with the standard library)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": question}]}
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def wait_until_healthy(url: str, timeout_s: float = 600.0) -> None:
    """Poll /health until the server answers (the engine thread has started)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not come up in {timeout_s:.0f} s")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    parser.add_argument("--draft", default="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    parser.add_argument("--no-draft", action="store_true", help="plain decoding, no head")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel devices")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel devices")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--num-slots", type=int, default=8, help="requests decoded at once")
    parser.add_argument("--capacity", type=int, default=1024,
                        help="tokens one slot holds, prompt plus reply")
    parser.add_argument("--question", default="Name three prime numbers.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--keep-serving", action="store_true",
                        help="after the first answer, serve until Ctrl-C")
    args = parser.parse_args(argv)

    # 1. The mesh: tp x dp devices. The target's weights are placed on it as they are read;
    #    the head (if any) is replicated on the same devices.
    mesh = eaglejax.make_mesh(tp=args.tp, dp=args.dp)
    target = eaglejax.load_target(args.model, mesh=mesh)
    draft = None if args.no_draft else eaglejax.load_draft(args.draft, target=target)

    # 2. The engine: `num_slots` rows of `capacity` tokens, continuous batching. With a head
    #    it picks the speculation shape per step ("auto"); pass `speculative=SpecConfig...`
    #    to fix one. warmup() compiles every program now, so no request waits for one.
    engine = Engine(target, draft, num_slots=args.num_slots, capacity=args.capacity)
    engine.warmup(progress=False)

    # 3. The HTTP app (FastAPI) on uvicorn, in a thread of this process. The app's lifespan
    #    starts and stops the engine's own thread.
    app = create_app(engine, model_name=args.model, default_max_tokens=args.max_tokens)
    sock = socket.socket()
    sock.bind((args.host, args.port))
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until_healthy(url)
        print(f"serving {args.model} on {url} over a tp={args.tp} x dp={args.dp} mesh "
              f"({engine.speculation or 'plain decoding'})")

        # 4. One round trip through the OpenAI-compatible API.
        reply = ask(url, args.model, args.question, args.max_tokens)
        answer = reply["choices"][0]["message"]["content"]
        print(f"Q: {args.question}\nA: {answer}")
        print(f"usage: {reply['usage']}, eaglejax: {reply.get('eaglejax')}")
        if args.keep_serving:
            print("serving until Ctrl-C")
            thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        # 5. A clean shutdown: uvicorn finishes, the lifespan stops the engine's thread.
        server.should_exit = True
        thread.join(60)
        sock.close()
    if thread.is_alive():
        raise RuntimeError("the server did not stop")
    print("server stopped")
    return reply


if __name__ == "__main__":
    main()
