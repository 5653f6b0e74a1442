"""A TCP relay that appends everything the server sends to a file, so a third-party client's
answers can be inspected (SGLang's bench_serving requests logprobs but does not keep them).

    python3 benchmarks/sglang_client/tee_proxy.py LISTEN_PORT SERVER_PORT LOG_FILE
"""

from __future__ import annotations

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, log=None) -> None:
    try:
        while data := await reader.read(65536):
            if log is not None:
                log.write(data)
                log.flush()
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def main(listen: int, target: int, path: str) -> None:
    with open(path, "ab") as log:
        async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
            sr, sw = await asyncio.open_connection("127.0.0.1", target)
            await asyncio.gather(_pipe(cr, sw), _pipe(sr, cw, log), return_exceptions=True)

        server = await asyncio.start_server(handle, "127.0.0.1", listen)
        async with server:
            await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
