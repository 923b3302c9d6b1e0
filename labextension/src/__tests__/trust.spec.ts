/**
 * What the sidebar believes of data other users can write: a lease's kernel id is its writer's
 * claim (issue 22). The server marks the leases of its own user's kernels `this_server`; the
 * sidebar must not take another user's lease naming one of our kernel ids for ours.
 */
import { myDevices, parseHolders, waitsEnded } from '../model';

const KID = 'abcdef0123456789';

/** Our kernel waited in line; now only another user's lease names its kernel id. */
function answer(
  waiting: boolean,
  user: string
): ReturnType<typeof parseHolders> {
  return parseHolders({
    user,
    errors: [],
    holders: [
      {
        kind: 'lease',
        uuid: 'GPU-2',
        label: 'GPU 2',
        user: 'mallory',
        kernel_id: KID,
        this_server: false
      }
    ],
    kernels: [
      {
        kernel_id: KID,
        notebook_path: 'train.ipynb',
        waiting,
        movable: false
      }
    ]
  });
}

describe("another user's lease naming our kernel", () => {
  it('does not end our wait in line (caught: this_server not checked)', () => {
    const waiting = new Set<string>();
    expect(waitsEnded(answer(true, 'me'), waiting)).toEqual([]);
    expect([...waiting]).toEqual([KID]);
    expect(waitsEnded(answer(false, 'me'), waiting)).toEqual([]);
  });

  it('is mine only through the active kernel, never through an unknown server user', () => {
    // a server that could not name its user ('') owns no holder whose user is unknown too
    const unnamed = parseHolders({
      user: '',
      errors: [],
      holders: [
        { kind: 'process', uuid: 'GPU-3', label: 'GPU 3', user: '', pid: 7 }
      ],
      kernels: []
    });
    expect([...myDevices(unnamed, null)]).toEqual([]);
    expect([...myDevices(answer(false, 'me'), null)]).toEqual([]);
  });
});
