/**
 * What jest can check of the sidebar's glue without a browser: the panel's poll ends with the
 * panel, and the request helper tells the server's own 404 (no autogpu handler) from autogpu's
 * (an unknown kernel). The rendering itself is tested in Chromium (tests/browser/).
 */
import { ServerConnection } from '@jupyterlab/services';

import { GPUPanel } from '../panel';
import { MISSING_SERVER_EXTENSION, requestAPI } from '../request';

function answer(status: number, body: string): Response {
  return {
    ok: status >= 200 && status < 300,
    status,
    statusText: status === 404 ? 'Not Found' : 'OK',
    text: async () => body
  } as unknown as Response;
}

describe('the sidebar panel', () => {
  it('stops polling for good when it is closed (disposed)', () => {
    const panel = new GPUPanel({
      activeNotebook: () => null,
      serverSettings: ServerConnection.makeSettings({ baseUrl: 'http://h/' })
    });
    const poll = panel.poll;
    expect(poll.isDisposed).toBe(false);
    panel.dispose();
    expect(panel.isDisposed).toBe(true);
    expect(poll.isDisposed).toBe(true); // caught: a closed sidebar polling on
    panel.dispose(); // twice is harmless
  });
});

describe('requestAPI', () => {
  const settings = ServerConnection.makeSettings({ baseUrl: 'http://h/' });
  let spy: jest.SpyInstance;

  afterEach(() => spy.mockRestore());

  async function failure(status: number, body: string): Promise<string> {
    spy = jest
      .spyOn(ServerConnection, 'makeRequest')
      .mockResolvedValue(answer(status, body));
    try {
      await requestAPI('move', settings, { method: 'POST' });
    } catch (err) {
      return (err as Error).message;
    }
    throw new Error('no error');
  }

  it("says the server extension is missing for the server's own 404", async () => {
    expect(await failure(404, '<html>404: Not Found</html>')).toBe(
      MISSING_SERVER_EXTENSION
    );
    expect(await failure(404, '')).toBe(MISSING_SERVER_EXTENSION);
  });

  it("passes on autogpu's own 404 (an unknown kernel) in its words", async () => {
    expect(
      await failure(
        404,
        JSON.stringify({ message: 'no kernel k-1 on this server' })
      )
    ).toBe('no kernel k-1 on this server');
  });

  it("passes on other errors' messages and returns a success's JSON", async () => {
    expect(
      await failure(409, JSON.stringify({ message: 'a move is pending' }))
    ).toBe('a move is pending');
    spy = jest
      .spyOn(ServerConnection, 'makeRequest')
      .mockResolvedValue(answer(200, '{"devices": []}'));
    expect(await requestAPI('devices', settings)).toEqual({ devices: [] });
    const calls = spy.mock.calls;
    expect(calls[calls.length - 1][0]).toBe('http://h/autogpu/api/v1/devices');
  });
});
