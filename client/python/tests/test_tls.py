"""The Python Client's TLS options reach the library: the files are read before connecting.

    PYTHONPATH=<build>/client/python python3 test_tls.py

(TLS end to end, with real servers and certificates, is tests/integration/security_test.cc.)
"""
import os
import tempfile
import unittest

import mainstay


class TlsOptionsTest(unittest.TestCase):
    def test_a_missing_ca_file_is_invalid_argument_naming_it(self):
        with self.assertRaises(mainstay.Error) as raised:
            mainstay.Client("127.0.0.1:1", job_id="job-1", job_token="t", timeout_s=1.0,
                            tls_ca_file="/nonexistent/mainstay-ca.pem")
        self.assertEqual(raised.exception.code, "INVALID_ARGUMENT")
        self.assertIn("/nonexistent/mainstay-ca.pem", raised.exception.message)

    def test_a_certificate_without_its_key_is_invalid_argument(self):
        with tempfile.TemporaryDirectory() as d:
            cert = os.path.join(d, "client.pem")
            with open(cert, "w") as f:
                f.write("not a certificate\n")
            with self.assertRaises(mainstay.Error) as raised:
                mainstay.Client("127.0.0.1:1", job_id="job-1", job_token="t", timeout_s=1.0, tls_cert_file=cert)
            self.assertEqual(raised.exception.code, "INVALID_ARGUMENT")
            self.assertIn("without its key file", raised.exception.message)

    def test_no_tls_options_means_plaintext_and_an_unreachable_coordinator(self):
        with self.assertRaises(mainstay.Error) as raised:
            mainstay.Client("127.0.0.1:1", job_id="job-1", job_token="t", timeout_s=0.5)
        self.assertIn(raised.exception.code, ("UNAVAILABLE", "DEADLINE_EXCEEDED"))


if __name__ == "__main__":
    unittest.main()
