"""`medbanana keys init DIR`: a local CA and an ES256 signing certificate for `generate --c2pa-cert/--c2pa-key`
(rundir/signing_keys.py does the work)."""

from __future__ import annotations

import sys
from pathlib import Path
from ..failures import EXIT_OK, EXIT_USAGE


def cmd_keys_init(args) -> int:
    from ..rundir.signing_keys import init_keys

    try:
        files = init_keys(args.dir, name=args.name, organisation=args.organisation, days=args.days, force=args.force)
    except FileExistsError as exc:
        print(f"medbanana keys init: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {files.ca} (the CA: give it to whoever checks the images, and to `verify --c2pa --trust`)\n"
          f"      {files.chain} (--c2pa-cert)\n"
          f"      {files.key} (--c2pa-key; mode 0600, keep it private: it is never copied into a run or a dataset)\n"
          f"signing certificate SHA-256: {files.fingerprint}\n"
          f"sign a run:  medbanana generate ... --c2pa-cert {files.chain} --c2pa-key {files.key}\n"
          f"check it:    medbanana verify DATASET --c2pa --trust {files.ca}")
    return EXIT_OK


def register(sub) -> None:
    p = sub.add_parser("keys", help="make a local certificate for signing images (C2PA)",
                       description="Signing keys for C2PA Content Credentials (pip install 'medbanana[c2pa]').")
    keys = p.add_subparsers(dest="keys_command", metavar="COMMAND", required=True)
    init = keys.add_parser("init", help="write a local CA and an ES256 signing certificate into DIR",
                           description="Write DIR/ca.pem (a local certificate authority), DIR/signer-chain.pem (an "
                                       "ES256 signing certificate with the extensions C2PA requires: key usage "
                                       "digitalSignature, extended key usage emailProtection, subject and authority "
                                       "key identifiers; then the CA) and DIR/signer.key (its private key, mode "
                                       "0600). The CA's own key is not kept. For users without an organisational "
                                       "certificate: readers trust these images only when given ca.pem.")
    init.add_argument("dir", type=Path, metavar="DIR", help="folder for the three files (created)")
    init.add_argument("--name", default="medbanana signer", help="the certificate's common name")
    init.add_argument("--organisation", default="medbanana user", help="the certificates' organisation name")
    init.add_argument("--days", type=int, default=825, help="validity in days (default 825)")
    init.add_argument("--force", action="store_true", help="replace files already in DIR")
    init.set_defaults(func=cmd_keys_init)
