"""A real MinIO server (S3-compatible object store) on a loopback port, for the s3:// tests.

The binary is built from Go modules by e2e/build-minio.sh (cached under ~/.cache/kaon/minio,
like the control plane). `MinioServer(workdir)` starts `minio server` on a free port with
its data in workdir, waits for /minio/health/live, and stops it by PID.

    with MinioServer(tmp) as s3:
        s3.client().make_bucket("models")          # minio.Minio, as the root user
        env = s3.env()                             # AWS_ACCESS_KEY_ID, _SECRET_ACCESS_KEY, _ENDPOINT_URL, _REGION
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from e2e.control_plane import _die_with_parent, free_port, terminate, wait_until_answering

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "e2e" / "build-minio.sh"
ACCESS_KEY, SECRET_KEY, REGION = "kaon-test-user", "kaon-test-secret-key", "us-east-1"


def build_minio() -> Path:
    """Run build-minio.sh (instant when cached; several minutes the first time)."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


class MinioServer:
    def __init__(self, workdir: Path, binary: Path | None = None, host: str = "127.0.0.1"):
        self.workdir, self.binary, self.host = Path(workdir), binary, host
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "minio.log"

    def __enter__(self) -> MinioServer:
        binary = self.binary or build_minio()
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "MINIO_ROOT_USER": ACCESS_KEY, "MINIO_ROOT_PASSWORD": SECRET_KEY,
               "MINIO_BROWSER": "off", "MINIO_UPDATE": "off", "MINIO_REGION": REGION,
               "HOME": str(self.workdir)}  # its config dir (~/.minio) stays in the test's temp dir
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(binary), "server", str(data), "--address", f"{self.host}:{self.port}",
                 "--console-address", f"{self.host}:{free_port()}", "--quiet"],
                stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        try:
            wait_until_answering(self.proc, f"{self.url}/minio/health/live", 60, "minio", f"see {self.log_path}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc:
            terminate(self.proc, grace=10)

    def env(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> dict[str, str]:
        """What a Secret for an s3:// InferenceService holds (AWS_* names, as `kaon fetch` reads them)."""
        return {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key,
                "AWS_ENDPOINT_URL": self.url, "AWS_REGION": REGION}

    def client(self):
        from minio import Minio

        return Minio(f"{self.host}:{self.port}", access_key=ACCESS_KEY, secret_key=SECRET_KEY, region=REGION,
                     secure=False)

    def upload_dir(self, bucket: str, prefix: str, directory: Path) -> None:
        client = self.client()
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)
        for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
            client.fput_object(bucket, f"{prefix}/{path.relative_to(directory)}".lstrip("/"), str(path))
