"""A raw checkpoint-socket client: one ``register`` line, the agent's reply printed as it came, then it stays
connected for HOLD seconds (its registration held) or exits at once. Standard library only, so it runs under
``python3 -S`` as any user.

    python3 -S tests/checkpoint_register.py SOCKET NAME [CONTRACT] [HOLD]
"""

import json
import socket
import sys
import time


def main() -> None:
    path, name = sys.argv[1], sys.argv[2]
    contract = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None
    hold = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    try:
        s.connect(path)
    except OSError as e:
        print(json.dumps({"op": "connect_failed", "errno": e.errno, "error": e.strerror}), flush=True)
        return
    msg = {"v": 1, "op": "register", "workload": name, **({"contract": contract} if contract else {})}
    s.sendall(json.dumps(msg).encode() + b"\n")
    reply = s.makefile("rb").readline()
    print(reply.decode().strip() or json.dumps({"op": "closed"}), flush=True)
    time.sleep(hold)
    s.close()


if __name__ == "__main__":
    main()
