"""Development certificates for mutual TLS:  python -m tools.certs [--out var/certs]

Makes, with the openssl command line, a development CA (ca.pem, ca.key) and
signs with it:
- one certificate per service (router, batcher, model-server, cache) for both
  server and client use, its SANs 127.0.0.1, localhost and the service's
  Kubernetes DNS names (NAME, NAME.NAMESPACE, NAME.NAMESPACE.svc,
  NAME.NAMESPACE.svc.cluster.local);
- client certificates for the development tenants (CN tenant-vip-dev,
  tenant-standard-dev) and an administrator (CN admin-dev).
Each is NAME.pem (the certificate) and NAME.key (its key, mode 0600). Files
already there are kept unless --force: the CA signs only what it made.
For development only: the CA's key lies beside what it signed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import tempfile

SERVICES = ("router", "batcher", "model-server", "cache")
CLIENTS = ("tenant-vip-dev", "tenant-standard-dev", "admin-dev")
NAMESPACE = "infermesh"
DAYS = 825  # the longest validity that clients (macOS, browsers) accept for a leaf


class CertError(RuntimeError):
    """openssl is missing or failed; the message carries its output."""


def _openssl(*args: str) -> None:
    executable = shutil.which("openssl")
    if executable is None:
        raise CertError("openssl is not installed; run 'make setup' (system-deps installs it)")
    done = subprocess.run([executable, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise CertError(f"openssl {args[0]} failed: {done.stderr.strip()}")


def _new_key(path: pathlib.Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-out", str(path))
    path.chmod(0o600)


def make_ca(out: pathlib.Path, name: str = "infermesh development CA") -> None:
    """A self-signed CA: out/ca.pem and out/ca.key."""
    _new_key(out / "ca.key")
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        str(out / "ca.key"),
        "-out",
        str(out / "ca.pem"),
        "-days",
        str(DAYS),
        "-subj",
        f"/O=infermesh/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE,pathlen:0",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        "-addext",
        "subjectKeyIdentifier=hash",
    )


def service_names(service: str, namespace: str = NAMESPACE) -> list[str]:
    """The DNS names a service is reached by: loopback and its Kubernetes Service."""
    return [
        "localhost",
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def sign(
    out: pathlib.Path, name: str, dns: list[str] = (), ips: list[str] = (), server: bool = True, uris: list[str] = ()
) -> None:
    """out/NAME.pem and out/NAME.key, signed by out/ca.pem: CN NAME, the given
    SANs, for client use and (with `server`) server use."""
    _new_key(out / f"{name}.key")
    sans = [f"DNS:{d}" for d in dns] + [f"IP:{ip}" for ip in ips] + [f"URI:{u}" for u in uris]
    usage = "serverAuth,clientAuth" if server else "clientAuth"
    with tempfile.TemporaryDirectory() as scratch:
        request, extensions = pathlib.Path(scratch, "request.csr"), pathlib.Path(scratch, "extensions.cnf")
        _openssl(
            "req", "-new", "-key", str(out / f"{name}.key"), "-out", str(request), "-subj", f"/O=infermesh/CN={name}"
        )
        extensions.write_text(
            "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            f"extendedKeyUsage={usage}\nauthorityKeyIdentifier=keyid\n"
            + (f"subjectAltName={','.join(sans)}\n" if sans else "")
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            str(request),
            "-CA",
            str(out / "ca.pem"),
            "-CAkey",
            str(out / "ca.key"),
            "-set_serial",
            "0x" + secrets.token_hex(16),
            "-days",
            str(DAYS),
            "-sha256",
            "-extfile",
            str(extensions),
            "-out",
            str(out / f"{name}.pem"),
        )


def make_all(out: pathlib.Path, force: bool = False, namespace: str = NAMESPACE) -> list[str]:
    """The CA, every service's and every client's certificate under `out`;
    returns the names made (what exists is kept unless `force`)."""
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    made = []
    if force or not (out / "ca.pem").exists():
        make_ca(out)
        made.append("ca")
        force = True  # a new CA: everything it is to verify is signed again
    for service in SERVICES:
        if force or not (out / f"{service}.pem").exists():
            sign(out, service, service_names(service, namespace), ["127.0.0.1"])
            made.append(service)
    for client in CLIENTS:
        if force or not (out / f"{client}.pem").exists():
            sign(out, client, server=False)
            made.append(client)
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("var/certs"))
    parser.add_argument("--namespace", default=NAMESPACE, help="the Kubernetes namespace in the services' DNS names")
    parser.add_argument("--force", action="store_true", help="make a new CA and sign everything again")
    args = parser.parse_args(argv)
    try:
        made = make_all(args.out, args.force, args.namespace)
    except CertError as exc:
        print(f"certs: {exc}", file=sys.stderr)
        return 1
    print(
        f"{args.out}: " + (f"made {', '.join(made)}" if made else "every certificate is there (--force makes new ones)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
