// Start s3rver on 127.0.0.1 on a free port; print {"port": N} once listening.
// Usage: node serve.js DIRECTORY
'use strict';
const S3rver = require('s3rver');

const server = new S3rver({
  address: '127.0.0.1',
  port: 0,
  directory: process.argv[2],
  silent: true,
  resetOnClose: true,
});
server.run().then(
  (info) => process.stdout.write(JSON.stringify({ port: info.port }) + '\n'),
  (err) => {
    process.stderr.write(String(err) + '\n');
    process.exit(1);
  },
);
const stop = () => server.close().then(() => process.exit(0), () => process.exit(1));
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
