/*
 * AdminShell: Apache's mqadmin (RocketMQ 4.9.8's MQAdminStartup), many commands in one JVM.
 *
 * Each mqadmin command run as its own process pays for a JVM start and the loading of some 3,000 classes: 2-4 s on
 * two busy cores, for a command that then takes a few hundred milliseconds. The test suite runs dozens of them, so
 * tests/rocketmq_peer.py keeps one AdminShell per session and sends it the commands one after the other.
 *
 *   java -Djava.security.manager=allow -cp "OUT:DIST/conf:DIST/lib/*" AdminShell
 *
 * Standard input: one command per line, its arguments separated by tabs (exactly what `mqadmin` takes, e.g.
 * "topicList<TAB>-n<TAB>127.0.0.1:9876"). For each one, standard output gets a line "LEN <bytes> <status>" and then
 * that many bytes: everything the command printed, on its standard output and error together, in the order printed.
 * The status is 0, or the code the command passed to System.exit (mqadmin calls it on an option it cannot parse;
 * here that ends the command, not the JVM), or 1 for an exception that escaped it.
 */

import java.io.BufferedReader;
import java.io.ByteArrayOutputStream;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.security.Permission;

import org.apache.rocketmq.tools.command.MQAdminStartup;

public class AdminShell {
    /** System.exit inside a command: thrown instead of ending the JVM (an Error, so that mqadmin's catch of Exception
     *  does not print it). */
    static final class Exit extends Error {
        final int status;

        Exit(int status) {
            super("exit " + status);
            this.status = status;
        }
    }

    @SuppressWarnings("removal")
    public static void main(String[] ignored) throws Exception {
        final Thread shell = Thread.currentThread();
        System.setSecurityManager(new SecurityManager() {
            @Override
            public void checkPermission(Permission perm) {
            }

            @Override
            public void checkPermission(Permission perm, Object context) {
            }

            @Override
            public void checkExit(int status) {
                if (Thread.currentThread() == shell) {
                    throw new Exit(status);
                }
            }
        });
        PrintStream out = System.out;
        PrintStream err = System.err;
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line;
        while ((line = in.readLine()) != null) {
            String[] args = line.split("\t", -1);
            ByteArrayOutputStream printed = new ByteArrayOutputStream();
            PrintStream both = new PrintStream(printed, true, StandardCharsets.UTF_8);
            int status = 0;
            System.setOut(both);
            System.setErr(both);
            try {
                MQAdminStartup.main0(args, null);
            } catch (Exit e) {
                status = e.status;
            } catch (Throwable t) {
                t.printStackTrace(both);
                status = 1;
            } finally {
                System.setOut(out);
                System.setErr(err);
            }
            both.flush();
            byte[] bytes = printed.toByteArray();
            out.print("LEN " + bytes.length + " " + status + "\n");
            out.write(bytes);
            out.flush();
        }
    }
}
